"""Sampling for the built-in engine's running batch: per-row parameters as tensors.

Sampling returns, per token, the log-prob under the distribution it was drawn from
after temperature, `log_softmax(logits / T)` (raw logits when T = 0, greedy); top-k /
top-p / min-p only restrict which tokens can be drawn, as in SGLang. Penalties, logit
bias and min_new_tokens change the logits first (`LogitShaping`, SGLang's order); a
batch in which no row asks for them carries no shaping state and pays nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_service.wire import GREEDY_BELOW


@dataclass
class LogitShaping:
    """Per-row state of the logit changes that depend on a row's tokens so far, applied
    before temperature in SGLang's order:

        logits -= frequency * count + presence * (count > 0)     (output tokens)
        logits  = logits / r if logits > 0 else logits * r       (prompt + output tokens)
        logits += logit_bias
        logits[stop tokens] = -inf  while fewer than min_new_tokens are out

    Rows that ask for none of it hold neutral values (0, 0, 1, no bias, 0)."""

    frequency: torch.Tensor  # (B,) float32
    presence: torch.Tensor  # (B,) float32
    repetition: torch.Tensor  # (B,) float32
    counts: torch.Tensor  # (B, V) float32: occurrences of each token in the output
    seen: torch.Tensor  # (B, V) bool: in the prompt or the output
    bias: torch.Tensor  # (B, V) float32
    min_left: torch.Tensor  # (B,) int64: tokens to go before a stop token may be drawn
    stops: torch.Tensor  # (B, V) bool: the row's stop tokens (EOS unless ignore_eos)

    @staticmethod
    def build(
        rows: Sequence[tuple[Sequence[int], Any]],
        vocab: int,
        eos: frozenset[int],
        device: torch.device,
    ) -> LogitShaping:
        """`rows`: (prompt ids, SamplingParamsIn) per row."""
        n = len(rows)
        out = LogitShaping.neutral(n, vocab, device)
        for b, (prompt, sp) in enumerate(rows):
            out.frequency[b] = sp.frequency_penalty
            out.presence[b] = sp.presence_penalty
            out.repetition[b] = sp.repetition_penalty
            out.seen[b, torch.tensor(list(prompt), dtype=torch.long, device=device)] = True
            for tok, value in sp.bias.items():
                out.bias[b, tok] = value
            out.min_left[b] = sp.min_new_tokens
            stop = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(eos))
            stop = {t for t in stop if 0 <= t < vocab}
            if stop:
                out.stops[b, torch.tensor(sorted(stop), device=device)] = True
        return out

    @staticmethod
    def neutral(n: int, vocab: int, device: torch.device) -> LogitShaping:
        return LogitShaping(
            frequency=torch.zeros(n, device=device),
            presence=torch.zeros(n, device=device),
            repetition=torch.ones(n, device=device),
            counts=torch.zeros(n, vocab, device=device),
            seen=torch.zeros(n, vocab, dtype=torch.bool, device=device),
            bias=torch.zeros(n, vocab, device=device),
            min_left=torch.zeros(n, dtype=torch.long, device=device),
            stops=torch.zeros(n, vocab, dtype=torch.bool, device=device),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V) float32 -> shaped logits (B, V)."""
        logits = logits - self.frequency[:, None] * self.counts
        logits = logits - self.presence[:, None] * (self.counts > 0)
        rep = torch.where(self.seen, self.repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
        logits = logits + self.bias
        block = self.stops & (self.min_left > 0)[:, None]
        return logits.masked_fill(block, float("-inf"))

    def observe(self, tokens: torch.Tensor) -> None:
        """Count the tokens (B,) just drawn."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.counts[rows, tokens] += 1
        self.seen[rows, tokens] = True
        self.min_left = (self.min_left - 1).clamp(min=0)

    def active(self) -> bool:
        """Whether any row still changes its logits."""
        return bool(
            (self.frequency != 0).any()
            or (self.presence != 0).any()
            or (self.repetition != 1).any()
            or (self.min_left > 0).any()
            or (self.bias != 0).any()
        )

    def select(self, idx: torch.Tensor) -> LogitShaping:
        return LogitShaping(*(getattr(self, f)[idx] for f in _SHAPING_FIELDS))

    @staticmethod
    def cat(a: LogitShaping, b: LogitShaping) -> LogitShaping:
        return LogitShaping(*(torch.cat([getattr(a, f), getattr(b, f)]) for f in _SHAPING_FIELDS))


_SHAPING_FIELDS = tuple(LogitShaping.__dataclass_fields__)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors on the model's device, shape (B,).
    `shaping`: None unless some row has penalties, logit bias or min_new_tokens."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, -1 = all
    min_p: torch.Tensor  # float32
    shaping: LogitShaping | None = None
    # Derived once per batch, not per step (each `.any()` is a host sync).
    greedy: torch.Tensor = field(init=False, repr=False)  # (B,) bool
    divisor: torch.Tensor = field(init=False, repr=False)  # (B, 1): T, 1 for greedy rows
    need_k: bool = field(init=False, repr=False)
    need_p: bool = field(init=False, repr=False)
    need_min: bool = field(init=False, repr=False)
    any_greedy: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.greedy = self.temperature <= 0
        self.any_greedy = bool(self.greedy.any())
        ones = torch.ones_like(self.temperature)
        self.divisor = torch.where(self.greedy, ones, self.temperature)[:, None]
        self.need_k = bool((self.top_k > 0).any())
        self.need_p = bool((self.top_p < 1).any())
        self.need_min = bool((self.min_p > 0).any())

    @staticmethod
    def build(rows: Sequence[Any], device: torch.device) -> SamplingTensors:
        """`rows`: objects with temperature, top_p, top_k, min_p attributes; a
        temperature below GREEDY_BELOW samples greedily."""
        temps = [0.0 if r.temperature < GREEDY_BELOW else r.temperature for r in rows]
        return SamplingTensors(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_p=torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device),
            top_k=torch.tensor([r.top_k for r in rows], dtype=torch.long, device=device),
            min_p=torch.tensor([r.min_p for r in rows], dtype=torch.float32, device=device),
        )

    def select(self, idx: torch.Tensor) -> SamplingTensors:
        shaping = self.shaping.select(idx) if self.shaping is not None else None
        return SamplingTensors(
            self.temperature[idx],
            self.top_p[idx],
            self.top_k[idx],
            self.min_p[idx],
            shaping if shaping is not None and shaping.active() else None,
        )

    def take(self, idx: torch.Tensor) -> SamplingTensors:
        """`select` for a batch that only loses rows, without deriving the flags again
        (each a host sync): a flag may stay set with no row left that needs it, which
        costs a pass that changes no value (top-k of all, top-p of 1, min-p of 0, greedy
        nowhere) and so no draw."""
        out = copy.copy(self)
        for name in ("temperature", "top_p", "top_k", "min_p", "greedy", "divisor"):
            setattr(out, name, getattr(self, name).index_select(0, idx))
        if self.shaping is not None:
            shaping = self.shaping.select(idx)
            out.shaping = shaping if shaping.active() else None
        return out

    @staticmethod
    def cat(a: SamplingTensors, b: SamplingTensors) -> SamplingTensors:
        return SamplingTensors(
            torch.cat([a.temperature, b.temperature]),
            torch.cat([a.top_p, b.top_p]),
            torch.cat([a.top_k, b.top_k]),
            torch.cat([a.min_p, b.min_p]),
            _cat_shaping(a, b),
        )


def _cat_shaping(a: SamplingTensors, b: SamplingTensors) -> LogitShaping | None:
    if a.shaping is None and b.shaping is None:
        return None
    ref = a.shaping if a.shaping is not None else b.shaping
    assert ref is not None
    vocab, device = ref.counts.shape[1], ref.counts.device
    sa = a.shaping or LogitShaping.neutral(a.temperature.shape[0], vocab, device)
    sb = b.shaping or LogitShaping.neutral(b.temperature.shape[0], vocab, device)
    return LogitShaping.cat(sa, sb)


RowGenerators = Sequence[torch.Generator | None]


def sample(
    logits: torch.Tensor,
    p: SamplingTensors,
    generator: torch.Generator | None,
    rows: RowGenerators = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits: (B, V). Returns tokens (B,) int64 and their
    log-probs (B,) float32 under log_softmax(logits / T) (T = 1 for greedy rows), the
    logits shaped first when `p.shaping` is set. `rows[b]`, when given and not None, is
    row b's own generator (a seeded request): its draws depend on its seed only, never
    on the other rows of the batch."""
    tokens, logp = draw(logits, p, generator, rows)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def draw(
    logits: torch.Tensor,
    p: SamplingTensors,
    generator: torch.Generator | None,
    rows: RowGenerators = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`, returning the whole log-prob matrix (B, V) instead of the drawn
    tokens' entries (for top_logprobs_num)."""
    logits = logits.float()
    if p.shaping is not None:
        logits = p.shaping.apply(logits)
    logp = torch.log_softmax(logits / p.divisor, dim=-1)  # (B, V)
    probs = _restrict(logp.exp(), p)
    # argmax(p / E) with E ~ Exp(1) draws from p (exponential race; faster than
    # torch.multinomial); rows with p = 0 can never win.
    race = _exponential(probs.shape, probs, generator)
    for b, own in enumerate(rows):
        if own is not None:
            race[b] = _exponential(probs.shape[1:], probs, own)
    drawn = (probs / race).argmax(dim=-1)  # (B,)
    tokens = torch.where(p.greedy, logits.argmax(dim=-1), drawn) if p.any_greedy else drawn
    return tokens, logp


def _exponential(
    shape: torch.Size, like: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """Exp(1) noise of `shape` as -log(U), U ~ Uniform[0, 1): on CPU a uniform draw and a
    vectorized log cost a fifth of torch's `exponential_`. U = 0 gives +inf, a token
    that cannot win this draw (probability 2^-24 per entry)."""
    u = torch.rand(shape, generator=generator, dtype=like.dtype, device=like.device)
    return u.log_().neg_()


def top_entries(logp: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """The k most likely (log-prob, token id) of each row of logp (B, V)."""
    vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]


def prompt_logprobs(
    logits: torch.Tensor, prompt: Sequence[int], start: int, temperature: float, top: int
) -> tuple[list[float | None], list[list[tuple[float, int]] | None]]:
    """Log-probs of prompt positions `start`.. (each given the tokens before it) under
    log_softmax(logits / T), and their `top` most likely alternatives (none: []).
    Position 0 has no log-prob (None). logits: (K, V), the forward's last K positions
    of this prompt, K >= len(prompt) - max(start, 1) + 1."""
    n, k = len(prompt), logits.shape[0]
    first = max(start, 1)
    head: list[Any] = [None] if start == 0 else []
    rows = logits[k - n + first - 1 : k - 1].float()  # (n - first, V): predict prompt[first:]
    if temperature >= GREEDY_BELOW:
        rows = rows / temperature
    logp = torch.log_softmax(rows, dim=-1)
    ids = torch.tensor(list(prompt[first:]), dtype=torch.long, device=logp.device)
    lps = logp.gather(1, ids[:, None]).squeeze(1).tolist() if len(ids) else []
    tops = top_entries(logp, top) if top and len(ids) else []
    return head + lps, (head + tops) if top else []


def _restrict(probs: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p, row by row. probs: (B, V)."""
    need_k, need_p, need_min = p.need_k, p.need_p, p.need_min
    if not (need_k or need_p or need_min):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
    drop = torch.zeros_like(sorted_p, dtype=torch.bool)
    if need_k:
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(p.top_k > 0, p.top_k, probs.shape[-1])
        drop |= rank >= k[:, None]
    if need_p:
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        drop |= (before >= p.top_p[:, None]) & (p.top_p < 1)[:, None]
    if need_min:
        drop |= sorted_p < (p.min_p * sorted_p[:, :1].squeeze(1))[:, None]
    drop[:, 0] = False  # the most likely token always stays
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(1, order, sorted_p)
