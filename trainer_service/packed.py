"""A micro-batch's prompts and completions as one packed sequence: no padding, one pass.

The rows of a micro-batch share prompts (a GRPO group's completions all continue one
prompt) and are padded to the longest row. Here each distinct prompt's tokens and then
every row's completion tokens run as one sequence (1, M) of real tokens only, each at its
absolute position (rotary embeddings are per token): the linear layers, norms, MLP and
head compute no padding and no prompt twice, and the model runs once (its fixed cost per
op is paid once, not for a prompt pass and a completion pass). Only attention sees the
rows: the attention function registered with transformers under `ATTENTION` gathers a
layer's queries, keys and values into two padded layouts and gathers the outputs back:

    sequence      (1, M)            the G prompts' tokens, then the B rows' completions
    prompts       (G, H, P, P)      causal within each prompt (padding after its tokens)
    completions   (B, H, T, P + T)  row r's tokens see its prompt's keys (padding masked)
                                    and, causally, its own
    logits        (G + N, V)        each prompt's last position, then every completion
                                    token's; token j of row r is scored at its position
                                    j - 1, token 0 at its prompt's last position

Every token sees exactly what it sees in the padded pass (SDPA; on CPU two batched
matmuls, `_cpu_attention`), so log-probs and gradients are the same up to float
rounding. Outside a packed pass the function is transformers' SDPA attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer_service.batching import MicroBatch

ATTENTION = "areal_packed_sdpa"
_ROWS = "packed_rows"  # the keyword that carries `PackedRows` down to attention


@dataclass
class PackedRows:
    """Where the packed sequence's M tokens go in the two padded layouts of attention:
    each index points into the sequence's rows plus one zero row (index M), which fills
    the padding. `layers` counts the attention calls that took them."""

    prompts: int  # G
    longest: int  # P
    rows: int  # B
    width: int  # T
    prompt_slots: torch.Tensor  # (G * P,) each prompt slot's token
    prompt_flat: torch.Tensor  # (Np,) each prompt token's slot, sequence order
    queries: torch.Tensor  # (B * T,) each completion slot's token
    keys: torch.Tensor  # (B * (P + T),) each row's prompt's slots, then its own
    flat: torch.Tensor  # (N,) each completion token's slot, sequence order
    mask: torch.Tensor  # (B, 1, T, P + T) which keys each completion slot sees
    layers: int = 0
    biases: dict[str, torch.Tensor] = field(default_factory=dict)  # `_cpu_attention`'s

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, dropout: float,
    ) -> torch.Tensor:  # fmt: skip
        """(1, H, M, D) queries, (1, K, M, D) keys and values -> (1, M, H, D) outputs."""
        import torch

        q, k, v = (_with_zero_row([x.squeeze(0).transpose(0, 1)]) for x in (query, key, value))
        g, p, b, t = self.prompts, self.longest, self.rows, self.width
        qp, kp, vp = (_layout(x, self.prompt_slots, g, p) for x in (q, k, v))
        causal = torch.ones(p, p, dtype=torch.bool, device=q.device).tril()
        op = self._attention("prompts", qp, kp, vp, causal.expand(g, 1, p, p), scaling, dropout)
        kc, vc = (_layout(x, self.keys, b, p + t) for x in (k, v))
        qc = _layout(q, self.queries, b, t)
        oc = self._attention("completions", qc, kc, vc, self.mask, scaling, dropout)
        return torch.cat([_unlayout(op, self.prompt_flat), _unlayout(oc, self.flat)])[None]

    def _attention(
        self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: torch.Tensor, scaling: float | None, dropout: float,
    ) -> torch.Tensor:  # fmt: skip
        import torch.nn.functional as F

        if q.device.type != "cpu":
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
        if name not in self.biases:  # the same for every layer
            self.biases[name] = _score_bias(mask, k.shape[1], q.shape[1], q.dtype)
        return _cpu_attention(q, k, v, self.biases[name], scaling, dropout)


def _layout(x: torch.Tensor, index: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """(M + 1, H, D) sequence rows -> (n, H, length, D) by `index` (n * length,)."""
    return _gather(x, index).view(n, length, *x.shape[1:]).transpose(1, 2)


def _unlayout(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(n, H, length, D) -> (len(flat), H, D): the real tokens' rows, sequence order."""
    n, h, length, d = x.shape
    return _gather(x.transpose(1, 2).reshape(n * length, h, d), flat)


def _score_bias(mask: torch.Tensor, kv_heads: int, heads: int, dtype: Any) -> torch.Tensor:
    """(n, 1, T, S) boolean mask -> (n * K, H / K * T, S) additive bias (0 or -inf), each
    key head's query heads stacked as `_cpu_attention` stacks them."""
    n, _, t, s = mask.shape
    bias = mask.new_zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    rep = heads // kv_heads
    return bias[:, None].expand(n, kv_heads, rep, t, s).reshape(-1, rep * t, s)


def _with_zero_row(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts`, then one zero row."""
    import torch

    return torch.cat([*parts, parts[0].new_zeros(1, *parts[0].shape[1:])])


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index), whose backward sums the gradient of each output row into
    its source row from a contiguous copy (the gradients attention hands back are strided,
    and a scatter over strided rows is slow)."""
    return _row_gather().apply(x, index)


@cache
def _row_gather() -> Any:
    import torch

    class RowGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(index)
            ctx.rows = x.shape[0]
            return x.index_select(0, index)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            (index,) = ctx.saved_tensors
            out = grad.new_zeros(ctx.rows, *grad.shape[1:])
            return out.index_add_(0, index, grad.contiguous()), None

    return RowGather


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed sequence (`_ROWS` given), else transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed: PackedRows | None = kwargs.pop(_ROWS, None)
    if packed is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    packed.layers += 1
    return packed.attend(query, key, value, scaling, dropout), None


def _cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """softmax(q k^T * scaling + bias) v with each key head's query heads stacked along
    the queries: (B, H, T, D) queries, (B, K, S, D) keys and values, (B * K, H / K * T, S)
    bias. On CPU, at these sizes (T and S in the tens, D 16), two batched matmuls over B * K
    take a quarter less than SDPA's flash kernel over B * H (forward and backward)."""
    import torch
    import torch.nn.functional as F

    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    scale = d**-0.5 if scaling is None else scaling
    scores = torch.baddbmm(
        bias, q.reshape(b * kv, h // kv * t, d), k.reshape(b * kv, s, d).transpose(1, 2),
        alpha=scale,
    )  # fmt: skip
    weights = torch.softmax(scores, dim=-1)
    if dropout > 0:
        weights = F.dropout(weights, dropout)
    return torch.bmm(weights, v.reshape(b * kv, s, d)).view(b, h, t, d)


def enable(model: Any) -> bool:
    """Give `model` (an HF causal LM on SDPA, or a DeepSpeed engine over one) the
    attention that runs packed rows; False, and `model` unchanged, where it cannot take
    it: another attention implementation, sliding-window layers, or a model class
    without transformers' attention interface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    module = getattr(model, "module", model)
    cfg = getattr(module, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl == ATTENTION:
        return True
    if impl != "sdpa" or not hasattr(module, "set_attn_implementation"):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return False
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # masks as for SDPA
    module.set_attn_implementation(ATTENTION)
    return getattr(cfg, "_attn_implementation", None) == ATTENTION


def enabled(model: Any) -> bool:
    """Whether `model` runs the packed-rows attention (`enable`)."""
    cfg = getattr(getattr(model, "module", model), "config", None)
    return getattr(cfg, "_attn_implementation", None) == ATTENTION


@dataclass
class _Sequence:
    """The packed sequence of a micro-batch and what scoring needs of it."""

    rows: PackedRows
    tokens: torch.Tensor  # (M,) the prompts' tokens, then the completions'
    positions: torch.Tensor  # (M,) absolute positions
    keep: torch.Tensor  # (G + N,) the positions whose logits score a token
    row_prompt: torch.Tensor  # (B,) each row's prompt among the G
    row: torch.Tensor  # (N,) each completion token's row
    j: torch.Tensor  # (N,) its index in its completion
    at: torch.Tensor  # (N,) where the (B, L - 1) layout holds its log-prob


def _sequence(mb: MicroBatch) -> _Sequence:
    """Pack `mb`: each distinct prompt once (from its first row), then every row's
    completion, real tokens only."""
    import torch

    assert mb.group is not None and mb.prompt_len is not None
    ids, plen = mb.input_ids, mb.prompt_len
    rows, width = ids.shape
    dev = ids.device
    _, row_prompt = torch.unique(mb.group, return_inverse=True)  # (B,)
    g = int(row_prompt.max()) + 1
    first = torch.full((g,), rows, dtype=torch.long, device=dev)
    first = first.scatter_reduce(0, row_prompt, torch.arange(rows, device=dev), "amin")
    gp = plen[first]  # (G,) prompt lengths
    p = int(gp.max())
    prompt_flat = (torch.arange(p, device=dev) < gp[:, None]).view(-1).nonzero().squeeze(1)
    prompt_tokens = ids[first[prompt_flat // p], prompt_flat % p]
    n_comp = mb.attention_mask.sum(dim=1) - plen  # (B,)
    t = int(n_comp.max())
    flat = (torch.arange(t, device=dev) < n_comp[:, None]).view(-1).nonzero().squeeze(1)
    row, j = flat // t, flat % t
    pos = plen[row] + j
    n_p, n = len(prompt_flat), len(flat)
    m = n_p + n  # the zero row's index
    prompt_slots = torch.full((g * p,), m, dtype=torch.long, device=dev)
    prompt_slots[prompt_flat] = torch.arange(n_p, device=dev)
    queries = torch.full((rows * t,), m, dtype=torch.long, device=dev)
    queries[flat] = torch.arange(n_p, m, device=dev)
    keys = torch.cat([prompt_slots.view(g, p)[row_prompt], queries.view(rows, t)], dim=1)
    # (B, 1, T, P + T): its prompt (padding masked), then causal over its own tokens
    seen = (torch.arange(p, device=dev) < plen[:, None])[:, None].expand(rows, t, p)
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(rows, t, t)
    mask = torch.cat([seen, causal], dim=-1)[:, None]
    layout = PackedRows(g, p, rows, t, prompt_slots, prompt_flat, queries, keys.view(-1),
                        flat, mask)  # fmt: skip
    last = torch.cumsum(gp, 0) - 1  # each prompt's last token in the sequence
    return _Sequence(
        rows=layout,
        tokens=torch.cat([prompt_tokens, ids[row, pos]]),
        positions=torch.cat([prompt_flat % p, pos]),
        keep=torch.cat([last, torch.arange(n_p, m, device=dev)]),
        row_prompt=row_prompt,
        row=row,
        j=j,
        at=row * (width - 1) + pos - 1,  # token j of row r is predicted at p_r - 1 + j
    )


def packed_logprobs(
    model: Any, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of `mb` ((B, L - 1), 0 off completion tokens) in one pass over
    the packed sequence; `model` runs the packed attention (`enable`) and `mb`'s rows
    know their groups and prompt lengths."""
    import torch

    seq = _sequence(mb)
    out = model(
        input_ids=seq.tokens[None], position_ids=seq.positions[None],
        attention_mask=seq.rows.mask, use_cache=False, logits_to_keep=seq.keep,
        **{_ROWS: seq.rows},
    )  # fmt: skip
    layers = getattr(model, "module", model).config.num_hidden_layers
    if seq.rows.layers != layers:
        raise RuntimeError(
            f"packed pass: {seq.rows.layers} of {layers} attention layers took the packed "
            f"rows (the model's attention must be {ATTENTION!r})"
        )
    g, n, rows = seq.rows.prompts, len(seq.row), seq.rows.rows
    tokens = seq.tokens[-n:] if n else seq.tokens[:0]
    # each completion position scores the token after it (a row's last scores the next
    # row's first, and is not used); each row's first token is scored at its prompt's end
    after = torch.cat([tokens[1:], tokens[:1]])
    temperature = mb.temperature.view(-1)
    logits = out.logits[0]  # (G + N, V)
    logp_pk, ent_pk = _score(logits[g:], temperature[seq.row], after, with_entropy, entropy_grad)
    first = mb.input_ids.gather(1, mb.prompt_len[:, None].clamp(max=mb.input_ids.shape[1] - 1))
    at_prompt = logits[:g].index_select(0, seq.row_prompt)  # (B, V)
    logp_pr, ent_pr = _score(at_prompt, temperature, first.squeeze(1), with_entropy, entropy_grad)
    src = torch.where(seq.j == 0, seq.row, rows + torch.arange(n, device=tokens.device) - 1)
    width = mb.input_ids.shape[1] - 1

    def place(prompt_part: torch.Tensor, packed_part: torch.Tensor) -> torch.Tensor:
        got = torch.cat([prompt_part, packed_part]).index_select(0, src)
        return got.new_zeros(rows * width).index_copy(0, seq.at, got).view(rows, width)

    entropy = None
    if with_entropy:
        assert ent_pr is not None and ent_pk is not None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = place(ent_pr, ent_pk)
    return place(logp_pr, logp_pk), entropy


def _score(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(M,) log-prob of `targets` under softmax(logits / T) of each (M, V) row, and (M,)
    its entropy if asked (with a graph only when `entropy_grad`)."""
    import torch

    from areal_hex.algorithms import entropy_from_logp

    logp_all = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_from_logp(logp_all)
