"""One generation request as the built-in engine tracks it, and its stop rules."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_service.wire import FinishReason, SamplingParamsIn


class EngineError(Exception):
    """A request the engine refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LogprobSpec:
    """Which log-probs beyond the sampled tokens' a request wants (SGLang's
    `logprob_start_len` and `top_logprobs_num`)."""

    start: int = -1  # first prompt position to score; -1: none
    top: int = 0  # most likely alternatives per position

    @property
    def scores_prompt(self) -> bool:
        return self.start >= 0


NO_EXTRA_LOGPROBS = LogprobSpec()
TopEntry = list[tuple[float, int]]  # (logprob, token id), most likely first


@dataclass(eq=False)
class GenRequest:
    rid: str
    prompt: list[int]
    sampling: SamplingParamsIn
    want: LogprobSpec = NO_EXTRA_LOGPROBS
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per output token
    output_top: list[TopEntry] = field(default_factory=list)  # one per output token
    # one per prompt position from want.start (position 0 has no log-prob: None)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopEntry | None] = field(default_factory=list)
    grammar: Any = None  # constrained decoding: the request's matcher (server.grammar)
    generator: Any = None  # a seeded request's torch.Generator (made by the step loop)
    versions: list[str] = field(default_factory=list)  # weight version of each output token
    finish: FinishReason | None = None
    weight_version: str = ""  # the server's version when the request finished
    created: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0
    submitted: bool = False  # handed to the step-loop thread
    retractions: int = 0  # times its KV cache was recomputed (a retract-mode reload)
    # Called once, from the thread that finishes the request.
    on_done: Callable[[GenRequest], None] | None = None
    # Called after each new output token (step-loop thread), for streaming.
    on_token: Callable[[GenRequest], None] | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def latency(self) -> float:
        return (self.finished_at or time.monotonic()) - self.created


def check_request(
    prompt: list[int], sampling: SamplingParamsIn, want: LogprobSpec, vocab: int, context: int
) -> None:
    """Refuse (EngineError) a request the engine cannot run: an empty or too long prompt,
    token ids outside the vocabulary, log-prob options past the prompt or vocabulary."""
    if not prompt:
        raise EngineError("input_ids: the prompt is empty")
    if len(prompt) > context:  # before the checks that read every id
        raise EngineError(f"prompt: {len(prompt)} tokens exceed the context length {context}")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise EngineError(f"input_ids: token id {bad[0]} outside the vocabulary [0, {vocab})")
    bad = [t for t in sampling.bias if not 0 <= t < vocab]
    if bad:
        raise EngineError(
            f"sampling_params.logit_bias: token id {bad[0]} outside the vocabulary [0, {vocab})"
        )
    if want.start >= len(prompt):
        raise EngineError(
            f"logprob_start_len ({want.start}) must be below the prompt length ({len(prompt)})"
        )
    if want.top > vocab:
        raise EngineError(f"top_logprobs_num ({want.top}) exceeds the vocabulary ({vocab})")
    total = len(prompt) + sampling.max_new_tokens
    if total > context:
        raise EngineError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
            f"= {total} exceeds the context length {context}"
        )


def check_stop(
    req: GenRequest,
    token: int,
    eos_ids: frozenset[int],
    decode_tail: Callable[[list[int]], str] | None,
) -> FinishReason | None:
    """The finish reason once `token` (already appended to req.output_ids) is out.
    Before `min_new_tokens` only the length limit ends a request (the step loop also
    keeps stop tokens from being drawn)."""
    s = req.sampling
    if req.grammar is not None:
        # a complete grammar allows only EOS; that EOS ends the request even with
        # ignore_eos
        if req.grammar.is_error():
            return FinishReason(type="abort", message=f"grammar: {req.grammar.get_error()}")
        if req.grammar.is_stopped() and token in eos_ids:
            return FinishReason(type="stop", matched=token)
    if len(req.output_ids) < s.min_new_tokens:
        return None
    if token in s.stop_ids or (not s.ignore_eos and token in eos_ids):
        return FinishReason(type="stop", matched=token)
    if s.stop_texts and decode_tail is not None:
        width = max(len(x) for x in s.stop_texts) + 1
        tail = decode_tail(req.output_ids[-width:])
        for text in s.stop_texts:
            if text in tail:
                return FinishReason(type="stop", matched=text)
    if len(req.output_ids) >= s.max_new_tokens:
        return FinishReason(type="length", length=s.max_new_tokens)
    return None


def trimmed_text(tokenizer: Any | None, req: GenRequest, upto: int) -> str:
    """The text of the first `upto` output tokens; once the request has stopped on a stop
    token or string, without it (SGLang's trim) unless `no_stop_trim`. Empty without a
    tokenizer."""
    if tokenizer is None:
        return ""
    params = req.sampling
    ids = req.output_ids[:upto]
    finish = req.finish if upto == len(req.output_ids) else None
    matched = finish.matched if finish is not None and finish.type == "stop" else None
    trim = matched is not None and not params.no_stop_trim
    if trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = str(tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens))
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


@dataclass
class EngineOptions:
    device: str = "cpu"
    max_running_requests: int = 64
    context_length: int = 512
    max_prefill_tokens: int = 8192  # padded prompt tokens per prefill forward
    # While rows run and more requests wait than fit: admit once this many fit (None: a
    # quarter of max_running_requests).
    min_admit: int | None = None
    seed: int = 0
    throughput_window_s: float = 5.0

    def admit_at_least(self) -> int:
        return self.min_admit or max(1, self.max_running_requests // 4)


@dataclass
class Control:
    """A command for the step loop, run between two decode steps; `result` answers it."""

    kind: str  # "abort" | "reload" | "hold" | "release"
    args: dict[str, Any] = field(default_factory=dict)
    result: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
