"""Constrained decoding for the built-in engine: SGLang's `regex`, `json_schema` and
`ebnf` sampling parameters, with llguidance (a Rust grammar engine with CPU wheels).

Each constrained request owns a matcher. Before a token is drawn, the matcher's bitmask
of allowed next tokens sets every other logit to -inf; after, the drawn token is fed
back. When the grammar is complete the matcher allows only EOS, so the request ends
there. Requests without a grammar never touch this module.

llguidance is imported on first use: a server that gets no constrained request does not
need it.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout_service.server.requests import EngineError

Matcher = Any  # llguidance.LLMatcher


class _TokenBytes:
    """What llguidance's TokenizerWrapper reads from a tokenizer it cannot load itself
    (e.g. a character-level one): each token's bytes, EOS, and an encoder."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        special = set(tokenizer.all_special_ids)
        size = min(vocab, len(tokenizer))
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [
            b"" if i in special else tokenizer.decode([i]).encode("utf-8") for i in range(size)
        ]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class Grammars:
    """Compiles a request's grammar into a matcher over the model's vocabulary."""

    def __init__(self, tokenizer: Any | None, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self._ll: Any = None  # llguidance.LLTokenizer, built on first use

    def _lltokenizer(self) -> Any:
        if self._ll is None:
            import llguidance
            import llguidance.hf

            try:  # byte-level BPE and sentencepiece tokenizers
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab)
            except ValueError:
                wrapper = llguidance.TokenizerWrapper(_TokenBytes(self.tokenizer, self.vocab))
                self._ll = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab)
        return self._ll

    def matcher(self, kind: str, text: str) -> Matcher:
        """A fresh matcher for `kind` ("regex" | "json_schema" | "ebnf") `text`;
        EngineError (400) naming the field when the grammar does not compile."""
        field = f"sampling_params.{kind}"
        if self.tokenizer is None:
            raise EngineError(f"{field}: constrained decoding needs a tokenizer")
        from llguidance import LLMatcher, grammar_from

        try:
            grammar = grammar_from(kind, text)  # type: ignore[arg-type]
        except ValueError as exc:
            raise EngineError(f"{field}: {exc}") from None
        matcher = LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise EngineError(f"{field}: {matcher.get_error()}")
        return matcher


def apply(logits: torch.Tensor, rows: list[tuple[int, Matcher]]) -> torch.Tensor:
    """logits (B, V) with every token a row's matcher forbids at -inf; `rows`: (row
    index, matcher) of the constrained rows. Returns a new tensor."""
    from llguidance.torch import fill_next_token_bitmask

    vocab = logits.shape[1]
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)  # (R, W)
    for k, (_, matcher) in enumerate(rows):
        fill_next_token_bitmask(matcher, bitmask, k)
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (R, W, 32)
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool().to(logits.device)  # (R, V)
    idx = torch.tensor([b for b, _ in rows], device=logits.device)
    out = logits.clone()
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out
