"""The running batch of the built-in engine: one KV cache for all live sequences.

Sequences are stacked with LEFT padding: row b of every cache tensor holds that
sequence's keys/values right-aligned at the batch's current length, and `mask[b]` marks
its real columns. All rows therefore write their next key/value at the same column, so
a decode step is one forward of shape (B, 1) with per-row position ids. The cache lives
in preallocated buffers with spare columns (rebuilt twice as wide as the columns in use
when full): a decode step writes its column in place instead of concatenating a new
copy of the cache.

- New requests are prefilled together (their own left-padded batch), then join the
  running batch between decode steps: written into spare rows of its buffers (`admit`,
  right-aligned at its length), or where they do not fit, merged with it into new
  buffers (the shorter cache left-padded to the longer one's length).
- Prefill and decode run `decoder.Decoder` (the same operations as HF's modules,
  without their Python layers) where the model supports it, else HF's forward.
- Finished rows leave in place (`remove`): the last rows move into their slots, so a
  step copies the rows that move, not the whole cache. Leading columns that became
  padding in every remaining row are skipped by attention (`start`) and cut when the
  buffers are next rebuilt (full, or a merge), so the work stays that of the longest
  live sequence.

Each row samples with its own parameters (`sampling.SamplingTensors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout_service.server.decoder import Decoder
from rollout_service.server.sampling import SamplingTensors


@dataclass
class KVBatch:
    """Left-padded KV state of B live sequences, in preallocated buffers.

    keys, values: per layer (B, H_kv, cap, D); columns [0, length) are in use, each row's
        entries right-aligned at `length` (its left padding before them)
    cols: (B, cap) bool, True where the column holds a real token of that row (read
        from `start` on: the columns before it may be unset)
    length: columns in use; a decode step writes column `length` of every row in place
        (the buffers are rebuilt when it reaches cap), so a token costs no copy of the cache
    pos: (B,) int64, the position id of each row's next token, which is also how many
        columns the row uses: [length - pos, length)
    last: (B,) int64, the token each row feeds into the next decode step
    params: per-row sampling parameters
    start: columns [0, start) are padding in every row (attention skips them)
    store: the whole buffers when they have rows to spare (keys, values and cols are
        then their first B rows): new rows are written there (`admit`), not merged
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cols: torch.Tensor
    length: int
    pos: torch.Tensor
    last: torch.Tensor
    params: SamplingTensors
    start: int = 0
    store: Store | None = None

    @property
    def size(self) -> int:
        return int(self.cols.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.cols.shape[1])

    @property
    def mask(self) -> torch.Tensor:
        """(B, length - start) bool: the real columns of each row from `start` on."""
        return self.cols[:, self.start : self.length]

    def used(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """`t` (cols, or a layer's keys/values) from column `start` on, and how many of
        its columns are in use (for `_buffers`)."""
        n = self.length - self.start
        return t.narrow(1 if t.dim() == 2 else t.dim() - 2, self.start, n), n


@dataclass
class Store:
    """Buffers of a running batch with spare rows: keys, values per layer (R, H_kv, cap, D)
    and cols (R, cap); the batch's B live rows are the first B."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cols: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.cols.shape[0])

    def views(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """keys, values and cols of the first n rows."""
        return [k[:n] for k in self.keys], [v[:n] for v in self.values], self.cols[:n]


def _room(columns: int) -> int:
    """Buffer columns for a batch of `columns`: twice as many, so that growing by one
    column a step copies the cache O(log n) times, not n."""
    return max(32, 2 * columns)


def _buffers(
    parts: Sequence[tuple[torch.Tensor, int]], width: int, cap: int, rows: int = 0
) -> torch.Tensor:
    """Stack (tensor (B_i, ..., L_i, D) or (B_i, L_i), used columns L_i) row-wise into one
    buffer of `cap` columns (and at least `rows` rows; the spare ones stay unset), each
    part right-aligned at `width`. Columns past `width` stay unset: each is written
    before it is read. The left padding of a shorter part is zeroed, not left as it was:
    it is masked out of attention, but NaN garbage there would still poison real rows
    through 0 * NaN."""
    first = parts[0][0]
    dim = first.dim() - 2 if first.dim() == 4 else 1
    shape = list(first.shape)
    shape[0] = max(rows, sum(t.shape[0] for t, _ in parts))
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
    shared: bool = False,
) -> tuple[KVBatch, torch.Tensor]:
    """`prefill`, returning the logits of the last `keep` columns, (B, keep, V) (prompt
    log-probs need more than the final position).

    Identical prompts (a GRPO group's samples arrive together) are computed once and
    their KV rows copied: the same numbers for a fraction of the work. With `shared`
    and one distinct prompt, the rows are views of its one row instead (no copy): such a
    batch can join another (`admit`, `merge`), be selected or owned (`own`), each a
    copy, but not be stepped (its rows would write to the same memory)."""
    first: dict[tuple[int, ...], int] = {}
    rows = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return _prefill(model, prompts, params, pad_id, keep, decoder)
    uniq = [list(p) for p in first]
    idx = torch.tensor([rows.index(i) for i in range(len(uniq))], device=params.temperature.device)
    one, logits = _prefill(model, uniq, params.select(idx), pad_id, keep, decoder)
    if shared and len(uniq) == 1:
        n = len(prompts)
        zeros = torch.zeros(n, dtype=torch.long, device=one.pos.device)
        batch = KVBatch(
            keys=[k.expand(n, *k.shape[1:]) for k in one.keys],
            values=[v.expand(n, *v.shape[1:]) for v in one.values],
            cols=one.cols.expand(n, -1),
            length=one.length,
            pos=one.pos.index_select(0, zeros),
            last=one.last.index_select(0, zeros),
            params=params,
        )
    else:
        batch = select(one, rows)
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
        _rebuild(batch)
    column, start = batch.length, batch.start
    batch.cols[:, column] = True
    if decoder is not None:
        mask = batch.cols[:, None, None, start : column + 1]  # (B, 1, 1, L + 1 - start)
        cache = batch.keys, batch.values
        tokens, pos = batch.last[:, None], batch.pos[:, None]
        logits = decoder.forward(tokens, pos, *cache, column, mask, start=start)[:, -1]
    else:
        logits = _hf_decode(model, batch, column)
    batch.length = column + 1
    batch.pos = batch.pos + 1
    return logits


def _hf_decode(model: Any, batch: KVBatch, column: int) -> torch.Tensor:
    """HF's forward over the cache's used columns; its new column is copied back in."""
    from transformers import DynamicCache

    start = batch.start
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        cache.update(k[:, :, start:column], v[:, :, start:column], i)
    out = model(
        input_ids=batch.last[:, None],
        attention_mask=_attention(model, batch.cols[:, start : column + 1], 1),
        position_ids=batch.pos[:, None],
        past_key_values=cache,
        use_cache=True,
    )
    for layer, k, v in zip(out.past_key_values.layers, batch.keys, batch.values, strict=True):
        k[:, :, column : column + 1] = layer.keys[:, :, -1:]
        v[:, :, column : column + 1] = layer.values[:, :, -1:]
    return out.logits[:, -1, :]


def own(batch: KVBatch, rows: int = 0) -> KVBatch:
    """`batch` in new buffers of its own: its columns from `start` on, with as many free
    again (`_room`), and at least `rows` rows (the spare ones for `admit`)."""
    n = batch.length - batch.start
    cap = _room(n)
    store = Store(
        keys=[_buffers([batch.used(k)], n, cap, rows) for k in batch.keys],
        values=[_buffers([batch.used(v)], n, cap, rows) for v in batch.values],
        cols=_buffers([batch.used(batch.cols)], n, cap, rows),
    )
    keys, values, cols = store.views(batch.size)
    return KVBatch(
        keys=keys,
        values=values,
        cols=cols,
        length=n,
        pos=batch.pos,
        last=batch.last,
        params=batch.params,
        store=store if rows else None,
    )


def _rebuild(batch: KVBatch) -> None:
    """New buffers for a full cache (`own`), with as many rows as before."""
    fresh = own(batch, batch.store.rows if batch.store else 0)
    batch.keys, batch.values, batch.cols, batch.store = (
        fresh.keys,
        fresh.values,
        fresh.cols,
        fresh.store,
    )
    batch.length, batch.start = fresh.length, 0


def merge(a: KVBatch, b: KVBatch, rows: int = 0) -> KVBatch:
    """Stack b's rows under a's, both right-aligned at the longer one's length (from
    each one's `start`), in new buffers of at least `rows` rows."""
    width = max(a.length - a.start, b.length - b.start)
    cap = _room(width)

    def stack(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _buffers([a.used(x), b.used(y)], width, cap, rows)

    store = Store(
        keys=[stack(x, y) for x, y in zip(a.keys, b.keys, strict=True)],
        values=[stack(x, y) for x, y in zip(a.values, b.values, strict=True)],
        cols=stack(a.cols, b.cols),
    )
    n = a.size + b.size
    keys, values, cols = store.views(n)
    return KVBatch(
        keys=keys,
        values=values,
        cols=cols,
        length=width,
        pos=torch.cat([a.pos, b.pos]),
        last=torch.cat([a.last, b.last]),
        params=SamplingTensors.cat(a.params, b.params),
        store=store if rows else None,
    )


def admit(a: KVBatch, b: KVBatch, rows: int) -> KVBatch:
    """`merge`, in place where it can be: b's rows written into the spare rows of a's
    buffers, right-aligned at a's length (only b is copied), when they are free and b's
    columns fit before that length; else `merge` into new buffers of `rows` rows. The
    columns that join the attended span [start, length) as padding are zeroed."""
    store, n, span = a.store, a.size + b.size, b.length - b.start
    if store is None or n > store.rows or span > a.length:
        return merge(a, b, rows)
    first = a.length - span  # b's first column in a
    start = min(a.start, first)
    new = slice(a.size, n)
    for full, part in zip((*store.keys, *store.values), (*b.keys, *b.values), strict=True):
        full[new, :, first : a.length] = part[:, :, b.start : b.length]
        full[new, :, start:first] = 0
        full[: a.size, :, start : a.start] = 0
    store.cols[: a.size, start : a.start] = False  # unset before a.start (a rule of cols)
    store.cols[new, start:first] = False
    store.cols[new, first : a.length] = b.cols[:, b.start : b.length]
    keys, values, cols = store.views(n)
    return KVBatch(
        keys=keys,
        values=values,
        cols=cols,
        length=a.length,
        pos=torch.cat([a.pos, b.pos]),
        last=torch.cat([a.last, b.last]),
        params=SamplingTensors.cat(a.params, b.params),
        start=start,
        store=store,
    )


def remove(batch: KVBatch, keep: list[int]) -> list[int]:
    """Keep rows `keep` (ascending), in place: each row that leaves from among the
    first len(keep) is overwritten by a kept row from beyond them, and every tensor is
    cut to len(keep) rows. Only the rows that move are copied, and of them only the
    columns in use, [start, length) (`select` copies the whole cache). Returns the old
    index of each row now in the batch; `start` moves to the first column a remaining
    row uses."""
    n = len(keep)
    kept = set(keep)
    holes = [i for i in range(n) if i not in kept]
    movers = [i for i in keep if i >= n]  # as many as the holes
    order = list(range(n))
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    if holes:
        device = batch.cols.device
        dst = torch.tensor(holes, dtype=torch.long, device=device)
        src = torch.tensor(movers, dtype=torch.long, device=device)
        for t in (*batch.keys, *batch.values, batch.cols):
            # columns before `start` are padding in every row and never read again; those
            # from `length` on are written before they are read
            used, _ = batch.used(t)
            used.index_copy_(0, dst, used.index_select(0, src))
        idx = torch.tensor(order, dtype=torch.long, device=device)
        batch.pos, batch.last = batch.pos.index_select(0, idx), batch.last.index_select(0, idx)
    else:
        idx = torch.arange(n, device=batch.cols.device)
        batch.pos, batch.last = batch.pos[:n], batch.last[:n]
    batch.params = batch.params.take(idx)
    batch.keys = [k[:n] for k in batch.keys]
    batch.values = [v[:n] for v in batch.values]
    batch.cols = batch.cols[:n]
    # row b holds its pos[b] tokens so far in columns [length - pos[b], length)
    batch.start = batch.length - int(batch.pos.max())
    return order


def select(batch: KVBatch, keep: list[int]) -> KVBatch:
    """Keep rows `keep` (in that order) and cut columns that are padding in all of them."""
    idx = torch.tensor(keep, dtype=torch.long, device=batch.cols.device)
    mask = batch.mask.index_select(0, idx)
    live = mask.any(dim=0).nonzero()
    skip = int(live[0]) if live.numel() else mask.shape[1]  # columns from batch.start
    start, mask = batch.start + skip, mask[:, skip:]
    n = batch.length - start
    cap = _room(n)

    def cut(t: torch.Tensor) -> torch.Tensor:  # rows `keep`, columns [start, length)
        # gathered straight into the new buffer's first n columns: one copy, not two
        out = t.new_empty((len(keep), *t.shape[1:-2], cap, t.shape[-1]))
        torch.index_select(t.narrow(-2, start, n), 0, idx, out=out.narrow(-2, 0, n))
        return out

    return KVBatch(
        keys=[cut(k) for k in batch.keys],
        values=[cut(v) for v in batch.values],
        cols=_buffers([(mask, n)], n, cap),
        length=n,
        pos=batch.pos.index_select(0, idx),
        last=batch.last.index_select(0, idx),
        params=batch.params.select(idx),
    )
