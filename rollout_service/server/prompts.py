"""Text prompts into token ids for both APIs of the inference server, off the event loop.

Tokenizing is CPU work proportional to the text (a 10 MB prompt took tens of seconds);
on the event loop it would stall every other request, `/health` included. So a text is
first bounded by its length in characters (`max_chars`, checked on the loop in
microseconds), then tokenized (and a chat template rendered) in a worker thread; the
token count is then bounded by the context length (`Engine.validate`). The limits are
listed in docs/api.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rollout_service.server.requests import EngineError

# Default character bound per text prompt: this many characters per token of context.
# Real text averages about 4 characters per token; a prompt that fits the context with
# more than 32 per token is pathological, and refusing it costs nothing.
CHARS_PER_CONTEXT_TOKEN = 32


def default_max_chars(context_length: int) -> int:
    return CHARS_PER_CONTEXT_TOKEN * context_length


def check_chars(chars: int, what: str, max_chars: int) -> None:
    if chars > max_chars:
        raise EngineError(
            f"{what}: {chars} characters, over this server's limit of {max_chars} "
            f"(characters per prompt; the context length bounds the tokens)"
        )


def require_tokenizer(tokenizer: Any | None, what: str) -> Any:
    if tokenizer is None:
        raise EngineError(f"{what}: this server has no tokenizer; send token ids")
    return tokenizer


def _encode_all(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


async def encode(
    tokenizer: Any | None, texts: Sequence[str], what: str, max_chars: int
) -> list[list[int]]:
    """Token ids of each text (no special tokens added, as SGLang's `/generate`)."""
    if not texts:
        return []
    tok = require_tokenizer(tokenizer, what)
    for text in texts:
        check_chars(len(text), what, max_chars)
    return await asyncio.to_thread(_encode_all, tok, list(texts))


def _render_chat(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as exc:  # the template is user data: any failure is a bad request
        raise EngineError(
            f"messages: the chat template failed: {type(exc).__name__}: {exc}"
        ) from None
    return str(text)


async def encode_chat(
    tokenizer: Any | None,
    messages: list[dict[str, Any]],
    kwargs: dict[str, Any],
    max_chars: int,
) -> list[int]:
    """Token ids of a chat rendered with the model's template (generation prompt added)."""
    tok = require_tokenizer(tokenizer, "messages")
    if not getattr(tok, "chat_template", None):
        raise EngineError("messages: this model's tokenizer has no chat template")
    check_chars(sum(len(str(m.get("content") or "")) for m in messages), "messages", max_chars)

    def work() -> list[int]:
        text = _render_chat(tok, messages, kwargs)
        check_chars(len(text), "messages (with the chat template)", max_chars)
        return list(tok.encode(text, add_special_tokens=False))

    return await asyncio.to_thread(work)
