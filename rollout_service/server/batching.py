"""The running batch of the built-in engine: one KV cache for all live sequences.

Sequences are stacked with LEFT padding: row b of every cache tensor holds that
sequence's keys/values right-aligned at the batch's current length, and `mask[b]` marks
its real columns. All rows therefore write their next key/value at the same column, so
a decode step is one forward of shape (B, 1) with per-row position ids. The cache lives
in preallocated buffers with spare columns (doubled when full): a decode step writes
its column in place instead of concatenating a new copy of the cache.

- New requests are prefilled together (their own left-padded batch), then merged into
  the running batch between decode steps (the shorter cache is left-padded to the
  longer one's length).
- Prefill and decode run `decoder.Decoder` (the same operations as HF's modules,
  without their Python layers) where the model supports it, else HF's forward.
- Finished rows leave by index-select; leading columns that became padding in every
  remaining row are cut, so the cache stays as long as the longest live sequence.

Sampling returns, per token, the log-prob under the distribution it was drawn from
after temperature, `log_softmax(logits / T)` (raw logits when T = 0, greedy); top-k /
top-p / min-p only restrict which tokens can be drawn, as in SGLang. Penalties, logit
bias and min_new_tokens change the logits first (`LogitShaping`, SGLang's order); a
batch in which no row asks for them carries no shaping state and pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_service.server.decoder import Decoder
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
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    for b, own in enumerate(rows):
        if own is not None:
            race[b] = torch.empty_like(probs[b]).exponential_(1.0, generator=own)
    drawn = (probs / race).argmax(dim=-1)  # (B,)
    tokens = torch.where(p.greedy, logits.argmax(dim=-1), drawn) if p.any_greedy else drawn
    return tokens, logp


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


@dataclass
class KVBatch:
    """Left-padded KV state of B live sequences, in preallocated buffers.

    keys, values: per layer (B, H_kv, cap, D); columns [0, length) are in use, each row's
        entries right-aligned at `length` (its left padding before them)
    cols: (B, cap) bool, True where the column holds a real token of that row
    length: columns in use; a decode step writes column `length` of every row in place
        (the buffers double when it reaches cap), so a token costs no copy of the cache
    pos: (B,) int64, the position id of each row's next token
    last: (B,) int64, the token each row feeds into the next decode step
    params: per-row sampling parameters
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cols: torch.Tensor
    length: int
    pos: torch.Tensor
    last: torch.Tensor
    params: SamplingTensors

    @property
    def size(self) -> int:
        return int(self.cols.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.cols.shape[1])

    @property
    def mask(self) -> torch.Tensor:
        """(B, length) bool: the real columns of each row."""
        return self.cols[:, : self.length]


def _room(columns: int) -> int:
    """Buffer columns for a batch of `columns`: twice as many, so that growing by one
    column a step copies the cache O(log n) times, not n."""
    return max(32, 2 * columns)


def _buffers(parts: Sequence[tuple[torch.Tensor, int]], width: int, cap: int) -> torch.Tensor:
    """Stack (tensor (B_i, ..., L_i, D) or (B_i, L_i), used columns L_i) row-wise into one
    buffer of `cap` columns, each part right-aligned at `width`. Columns past `width`
    stay unset: each is written before it is read. The left padding of a shorter part
    is zeroed, not left as it was: it is masked out of attention, but NaN garbage there
    would still poison real rows through 0 * NaN."""
    first = parts[0][0]
    dim = first.dim() - 2 if first.dim() == 4 else 1
    shape = list(first.shape)
    shape[0] = sum(t.shape[0] for t, _ in parts)
    shape[dim] = cap
    out = first.new_empty(shape)
    row = 0
    for t, used in parts:
        rows = out.narrow(0, row, t.shape[0])
        rows.narrow(dim, width - used, used).copy_(t.narrow(dim, 0, used))
        if used < width:
            rows.narrow(dim, 0, width - used).zero_()
        row += t.shape[0]
    return out


def _prebuilt_masks(model: Any) -> bool:
    """Whether we may hand the model its 4-D boolean mask ourselves: SDPA attention
    and full attention in every layer (HF otherwise rebuilds it on each call)."""
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    return getattr(cfg, "_attn_implementation", None) == "sdpa" and set(layer_types) == {
        "full_attention"
    }


def _attention(model: Any, mask: torch.Tensor, queries: int) -> torch.Tensor:
    """The attention mask argument for the last `queries` columns of `mask` (B, L).

    Prebuilt: (B, 1, queries, L) bool, True = may attend: causal within the new
    columns and never to a padding column (HF takes a 4-D mask as it is, in every
    model). A padding query row attends to itself only, so no row is fully masked (SDPA
    would return NaN for it, and NaN keys/values of padding would then poison real rows
    through 0 * NaN)."""
    if not _prebuilt_masks(model):
        return mask.long()
    keys = mask.bool()[:, None, None, :]  # (B, 1, 1, L)
    if queries == 1:
        return keys
    width = mask.shape[1]
    q_pos = torch.arange(width - queries, width, device=mask.device)[:, None]  # (q, 1)
    k_pos = torch.arange(width, device=mask.device)[None, :]  # (1, L)
    causal = (k_pos <= q_pos)[None, None]  # (1, 1, q, L)
    return (causal & keys) | (k_pos == q_pos)[None, None]


def prefill(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingTensors,
    pad_id: int,
    decoder: Decoder | None = None,
) -> tuple[KVBatch, torch.Tensor]:
    """Run the prompts as one left-padded batch. Returns the batch (its `last` not yet
    set) and the logits of each prompt's final position, (B, V). With `decoder` the
    lean forward runs, else HF's."""
    batch, logits = prefill_keep(model, prompts, params, pad_id, 1, decoder)
    return batch, logits[:, -1]


@torch.no_grad()
def prefill_keep(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingTensors,
    pad_id: int,
    keep: int,
    decoder: Decoder | None = None,
) -> tuple[KVBatch, torch.Tensor]:
    """`prefill`, returning the logits of the last `keep` columns, (B, keep, V) (prompt
    log-probs need more than the final position).

    Identical prompts (a GRPO group's samples arrive together) are computed once and
    their KV rows copied: the same numbers for a fraction of the work."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return _prefill(model, prompts, params, pad_id, keep, decoder)
    uniq = [list(p) for p in first]
    idx = torch.tensor([rows.index(i) for i in range(len(uniq))], device=params.temperature.device)
    batch, logits = _prefill(model, uniq, params.select(idx), pad_id, keep, decoder)
    batch = select(batch, rows)
    batch.params = params
    return batch, logits[rows]


def _prefill(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingTensors,
    pad_id: int,
    keep: int,
    decoder: Decoder | None,
) -> tuple[KVBatch, torch.Tensor]:
    device = params.temperature.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[b, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, L)
    pos = mask.sum(dim=1)
    cap = _room(width)
    if decoder is not None:
        keys, values = decoder.empty_cache(len(prompts), cap)
        allowed = _attention(model, mask, width)
        logits = decoder.forward(ids, positions, keys, values, 0, allowed, keep)
    else:
        keys, values, logits = _hf_prefill(model, ids, mask, positions, keep, cap)
    batch = KVBatch(
        keys=keys,
        values=values,
        cols=_buffers([(mask.bool(), width)], width, cap),
        length=width,
        pos=pos,
        last=pos.clone(),
        params=params,
    )
    return batch, logits


def _hf_prefill(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, keep: int, cap: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """HF's forward over a left-padded batch: the cache in buffers of `cap` columns, and
    the logits of the last `keep` positions (B, keep, V)."""
    from transformers import DynamicCache

    width = ids.shape[1]
    out = model(
        input_ids=ids,
        attention_mask=_attention(model, mask, width),
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=keep,
    )
    # right-aligned at `width` (a sliding-window layer may keep fewer columns)
    layers = list(out.past_key_values.layers)
    keys = [_buffers([(x.keys, x.keys.shape[2])], width, cap) for x in layers]
    values = [_buffers([(x.values, x.values.shape[2])], width, cap) for x in layers]
    return keys, values, out.logits[:, -keep:, :]


@torch.no_grad()
def decode_step(model: Any, batch: KVBatch, decoder: Decoder | None = None) -> torch.Tensor:
    """Feed each row's `last` token; returns next-token logits (B, V). With `decoder`
    (`decoder.for_model(model)`) the lean step runs, else HF's forward."""
    if batch.length == batch.capacity:
        _grow(batch)
    column = batch.length
    batch.cols[:, column] = True
    if decoder is not None:
        mask = batch.cols[:, None, None, : column + 1]  # (B, 1, 1, L + 1)
        cache = batch.keys, batch.values
        logits = decoder.forward(batch.last[:, None], batch.pos[:, None], *cache, column, mask)
        logits = logits[:, -1]
    else:
        logits = _hf_decode(model, batch, column)
    batch.length = column + 1
    batch.pos = batch.pos + 1
    return logits


def _hf_decode(model: Any, batch: KVBatch, column: int) -> torch.Tensor:
    """HF's forward over the cache's used columns; its new column is copied back in."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        cache.update(k[:, :, :column], v[:, :, :column], i)
    out = model(
        input_ids=batch.last[:, None],
        attention_mask=_attention(model, batch.cols[:, : column + 1], 1),
        position_ids=batch.pos[:, None],
        past_key_values=cache,
        use_cache=True,
    )
    for layer, k, v in zip(out.past_key_values.layers, batch.keys, batch.values, strict=True):
        k[:, :, column : column + 1] = layer.keys[:, :, -1:]
        v[:, :, column : column + 1] = layer.values[:, :, -1:]
    return out.logits[:, -1, :]


def _grow(batch: KVBatch) -> None:
    """Double the buffers' columns (the cache is full)."""
    n, cap = batch.length, 2 * batch.capacity
    batch.keys = [_buffers([(k, n)], n, cap) for k in batch.keys]
    batch.values = [_buffers([(v, n)], n, cap) for v in batch.values]
    batch.cols = _buffers([(batch.cols, n)], n, cap)


def merge(a: KVBatch, b: KVBatch) -> KVBatch:
    """Stack b's rows under a's, both right-aligned at the longer one's length."""
    width = max(a.length, b.length)
    cap = _room(width)

    def stack(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _buffers([(x, a.length), (y, b.length)], width, cap)

    return KVBatch(
        keys=[stack(x, y) for x, y in zip(a.keys, b.keys, strict=True)],
        values=[stack(x, y) for x, y in zip(a.values, b.values, strict=True)],
        cols=stack(a.cols, b.cols),
        length=width,
        pos=torch.cat([a.pos, b.pos]),
        last=torch.cat([a.last, b.last]),
        params=SamplingTensors.cat(a.params, b.params),
    )


def select(batch: KVBatch, keep: list[int]) -> KVBatch:
    """Keep rows `keep` (in that order) and cut columns that are padding in all of them."""
    idx = torch.tensor(keep, dtype=torch.long, device=batch.cols.device)
    mask = batch.mask.index_select(0, idx)
    live = mask.any(dim=0).nonzero()
    start = int(live[0]) if live.numel() else batch.length
    n = batch.length - start
    cap = _room(n)

    def cut(t: torch.Tensor) -> torch.Tensor:  # rows `keep`, columns [start, length)
        return _buffers([(t.narrow(-2, start, n).index_select(0, idx), n)], n, cap)

    return KVBatch(
        keys=[cut(k) for k in batch.keys],
        values=[cut(v) for v in batch.values],
        cols=_buffers([(mask[:, start:], n)], n, cap),
        length=n,
        pos=batch.pos.index_select(0, idx),
        last=batch.last.index_select(0, idx),
        params=batch.params.select(idx),
    )
