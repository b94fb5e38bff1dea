"""A micro-batch's completions as one packed sequence: no padding in the completion pass.

`shared_prompt.py` runs each distinct prompt once and then the completions as a (B, T)
batch padded to the longest one: with completions of 12 to 24 tokens about a fifth of
that pass is padding, which every linear layer, norm and MLP computes. Here the real
completion tokens run as one sequence (1, N), each at its absolute position (rotary
embeddings are per token), and only attention sees the rows: the attention function
registered with transformers under `ATTENTION` scatters a layer's queries, keys and
values into the (B, T) layout, puts each row's prompt keys and values (its prompt's, of
the G run once) before its own, and attends with the prompt-padding and causal mask
(SDPA; on CPU two batched matmuls, `_cpu_attention`), then gathers the real tokens
back. Every token sees exactly what it sees in the padded pass, so log-probs and
gradients are the same up to float rounding. Outside a packed pass the function is
transformers' SDPA attention itself.

    packed pass   (1, N)            the real completion tokens, row after row
    attention     (B, H, T, P + T)  row r's tokens see its prompt (padding masked) and
                                    its own earlier tokens
    logits        (N, V)            token j of row r from the row's position j - 1, token
                                    0 from its prompt's last position (the prompt pass)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainer_service.batching import MicroBatch

ATTENTION = "areal_packed_sdpa"
_ROWS = "packed_rows"  # the keyword that carries `PackedRows` down to the attention


@dataclass
class PackedRows:
    """Where the packed tokens go in the padded layouts of attention, and each layer's
    prompt keys and values; `layers` counts the attention calls that took them. A
    layout is filled by one row gather from [sources; a zero row]."""

    flat: torch.Tensor  # (N,) each packed token's slot in the (B * T) layout
    rows: int  # B
    width: int  # T
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (G, KV heads, P, D)
    queries: torch.Tensor  # (B * T,) each slot's packed token, N off them (the zero row)
    # (B * (P + T),) each key slot's row in [prompt keys (G * P); packed (N); zero]
    keys: torch.Tensor
    layers: int = 0
    bias: torch.Tensor | None = None  # `score_bias`, made by the first layer

    def score_bias(self, mask: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
        """(B, 1, T, S) boolean mask -> (B * K, H / K * T, S) additive bias (0 or -inf)
        for `_cpu_attention`; the same for every layer."""
        if self.bias is None:
            b, _, t, s = mask.shape
            bias = mask.new_zeros(mask.shape, dtype=self.prompt_kv[0][0].dtype)
            bias = bias.masked_fill(~mask, float("-inf"))
            rep = heads // kv_heads
            self.bias = bias[:, None].expand(b, kv_heads, rep, t, s).reshape(-1, rep * t, s)
        return self.bias

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """(1, H, N, D) -> (B, H, T, D), zeros off the real tokens."""
        rows = x.squeeze(0).transpose(0, 1)  # (N, H, D)
        out = _gather(_with_zero_row([rows]), self.queries)
        return out.view(self.rows, self.width, *rows.shape[1:]).transpose(1, 2)

    def with_prompt(self, prompt: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(G, H, P, D) prompt and (1, H, N, D) packed keys (or values) -> (B, H, P + T,
        D): each row's prompt's, then its own tokens (zeros after them)."""
        g, h, p, d = prompt.shape
        parts = [prompt.transpose(1, 2).reshape(g * p, h, d), x.squeeze(0).transpose(0, 1)]
        out = _gather(_with_zero_row(parts), self.keys)
        return out.view(self.rows, p + self.width, h, d).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> (1, N, H, D), the layout attention functions return."""
        b, h, t, d = x.shape
        return _gather(x.transpose(1, 2).reshape(b * t, h, d), self.flat).unsqueeze(0)


def packed_rows(
    real: torch.Tensor,
    row_prompt: torch.Tensor,
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
) -> PackedRows:
    """The layouts of the rows whose real tokens `real` (B, T) marks, row r continuing
    prompt `row_prompt[r]` of the (G, H, P, D) `prompt_kv`."""
    import torch

    rows, width = real.shape
    dev = real.device
    flat = real.view(-1).nonzero().squeeze(1)  # (N,) row-major
    n = flat.numel()
    queries = torch.full((rows * width,), n, dtype=torch.long, device=dev)
    queries[flat] = torch.arange(n, device=dev)
    g, _, p, _ = prompt_kv[0][0].shape
    prompt = row_prompt[:, None] * p + torch.arange(p, device=dev)  # (B, P)
    own = g * p + queries.view(rows, width)  # (B, T): the zero row off the tokens
    keys = torch.cat([prompt, own], dim=1).view(-1)
    return PackedRows(flat, rows, width, prompt_kv, queries, keys)


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
    """SDPA over packed rows (`_ROWS` given), else transformers' SDPA attention."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed: PackedRows | None = kwargs.pop(_ROWS, None)
    if packed is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    assert attention_mask is not None
    prompt_k, prompt_v = packed.prompt_kv[module.layer_idx]
    k, v = packed.with_prompt(prompt_k, key), packed.with_prompt(prompt_v, value)
    q = packed.pad_queries(query)
    if q.device.type == "cpu":
        out = _cpu_attention(q, k, v, packed.score_bias(attention_mask, k.shape[1], q.shape[1]),
                             scaling, dropout)  # fmt: skip
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
    packed.layers += 1
    return packed.unpad(out), None


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


def packed_logprobs(
    model: Any,
    mb: MicroBatch,
    at_prompt: torch.Tensor,
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
    row_prompt: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of `mb` ((B, L - 1), 0 off completion tokens) from the prompt
    pass's outputs: `at_prompt` (B, V) the logits at each row's last prompt position,
    `prompt_kv` each layer's prompt keys and values, `row_prompt` (B,) each row's
    prompt; the completions run packed."""
    import torch

    ids, plen = mb.input_ids, mb.prompt_len
    assert plen is not None
    rows, width = ids.shape
    dev = ids.device
    n_comp = mb.attention_mask.sum(dim=1) - plen  # (B,)
    t = int(n_comp.max())
    real = torch.arange(t, device=dev) < n_comp[:, None]  # (B, T)
    packed = packed_rows(real, row_prompt, prompt_kv)
    flat = packed.flat
    row, j = flat // t, flat % t
    pos = plen[row] + j  # (N,) absolute positions
    tokens = ids[row, pos]
    # (B, 1, T, P + T): its prompt (padding masked), then causal over its own tokens
    longest = prompt_kv[0][0].shape[2]
    seen = torch.arange(longest, device=dev) < plen[:, None]
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    mask = torch.cat([seen[:, None].expand(rows, t, longest), causal.expand(rows, t, t)], -1)
    out = model(
        input_ids=tokens[None], position_ids=pos[None], attention_mask=mask[:, None],
        use_cache=False, logits_to_keep=0, **{_ROWS: packed},
    )  # fmt: skip
    layers = len(prompt_kv)
    if packed.layers != layers:
        raise RuntimeError(
            f"packed completion pass: {packed.layers} of {layers} attention layers took the "
            f"packed rows (the model's attention must be {ATTENTION!r})"
        )
    # token j of row r: scored at the row's packed position j - 1, or (j = 0) at its
    # prompt's last position; each position scores the token after it (the next packed
    # one: a row's last position scores the next row's first, and is not used)
    n = flat.numel()
    after = torch.cat([tokens[1:], tokens[:1]])
    temperature = mb.temperature.view(-1)
    logp_pk, ent_pk = _score(out.logits[0], temperature[row], after, with_entropy, entropy_grad)
    first = ids.gather(1, plen[:, None].clamp(max=width - 1)).squeeze(1)  # (B,)
    logp_pr, ent_pr = _score(at_prompt, temperature, first, with_entropy, entropy_grad)
    src = torch.where(j == 0, row, rows + torch.arange(n, device=dev) - 1)  # (N,)
    # (B, L - 1) layout: token j of row r is predicted at position p_r - 1 + j
    at = row * (width - 1) + pos - 1

    def place(prompt_part: torch.Tensor, packed_part: torch.Tensor) -> torch.Tensor:
        got = torch.cat([prompt_part, packed_part]).index_select(0, src)
        return got.new_zeros(rows * (width - 1)).index_copy(0, at, got).view(rows, width - 1)

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
