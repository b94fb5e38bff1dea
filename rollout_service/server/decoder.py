"""A lean forward for the Llama family (Qwen3, Qwen2, Llama) over the engine's KV
buffers: the same tensor operations as HF's modules in the same order, without their
Python layers. It runs both the prefill (T prompt columns) and the decode step (T = 1).

On a small model a decode step is mostly Python overhead: HF's forward passes through
dozens of module calls, decorators, output records and config look-ups per layer, which
cost more than the arithmetic. This forward calls the torch operations directly on the
model's own parameters (so an in-place weight reload is seen at once; after a device
move the step loop builds it anew) and writes each layer's new keys/values into the
running batch's preallocated cache (`batching.KVBatch`) instead of growing it.

Per layer, as HF computes it (x: (B, T, hidden), the cache's used columns [0, L)):

    h = rms(x) ; q, k, v = proj(h)   (q_norm / k_norm on the head dim where the model has them)
    q, k = rope(q, k) ; cache[:, :, L : L + T] = k, v
    x = x + o_proj(sdpa(q, cache[:, :, : L + T], mask))   (GQA as HF: packed for one query,
                                                            repeated keys/values otherwise)
    x = x + down(silu(gate(rms(x))) * up(rms(x)))

`for_model` returns None for any other model (another architecture, eager attention,
sliding-window layers, a length-dependent RoPE, quantized or wrapped modules); the
engine then runs HF's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# HF classes whose decoder layers follow the scheme above exactly.
SUPPORTED = frozenset({"Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"})


@dataclass
class _Norm:
    weight: torch.Tensor  # a Parameter of the model (in-place reloads show through)
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # HF's operations with no casts and two of them in place: fewer and cheaper
            # calls than torch's rms_norm on CPU (which casts), the same numbers
            var = (x * x).mean(-1, keepdim=True)
            return (x * var.add_(self.eps).rsqrt_()).mul_(self.weight)
        # Qwen3RMSNorm / LlamaRMSNorm op for op: float32 statistics, cast back, then
        # scale
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Rope:
    """HF's rotary embedding as a table over positions, grown by doubling: a decode step
    looks its rows up instead of recomputing them (the same numbers: each entry is
    computed per position either way). sin is stored signed as (-sin, +sin) halves, so
    that rotate_half(x) * sin = swap_halves(x) * signed_sin."""

    def __init__(self, rotary: Any, dtype: torch.dtype, device: torch.device) -> None:
        self.rotary = rotary
        self.probe = torch.zeros((), dtype=dtype, device=device)
        self.cos = self.sin = torch.zeros((0, 0), dtype=dtype, device=device)

    def __call__(self, pos: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: (B, T) positions, all below `end`. Returns cos, signed sin (B, T, 1, D)."""
        if self.cos.shape[0] < end:
            self._build(max(2 * end, 64))
        shape = (*pos.shape, 1, self.cos.shape[-1])
        flat = pos.reshape(-1)
        cos, sin = self.cos.index_select(0, flat), self.sin.index_select(0, flat)
        return cos.view(shape), sin.view(shape)

    def _build(self, n: int) -> None:
        positions = torch.arange(n, device=self.probe.device)[None]  # (1, n)
        cos, sin = self.rotary(self.probe, positions)  # (1, n, D)
        half = sin.shape[-1] // 2
        self.cos = cos[0]
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


@dataclass
class _Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    norm_in: _Norm
    norm_post: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    q_norm: _Norm | None
    k_norm: _Norm | None
    gate: _Linear
    up: _Linear
    down: _Linear


def _norm(module: Any) -> _Norm:
    return _Norm(module.weight, float(module.variance_epsilon))


def _linear(module: Any) -> _Linear:
    return _Linear(module.weight, module.bias)


def _layer(block: Any) -> _Layer:
    attn, mlp = block.self_attn, block.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return _Layer(
        norm_in=_norm(block.input_layernorm),
        norm_post=_norm(block.post_attention_layernorm),
        q=_linear(attn.q_proj),
        k=_linear(attn.k_proj),
        v=_linear(attn.v_proj),
        o=_linear(attn.o_proj),
        q_norm=_norm(q_norm) if q_norm is not None else None,
        k_norm=_norm(k_norm) if k_norm is not None else None,
        gate=_linear(mlp.gate_proj),
        up=_linear(mlp.up_proj),
        down=_linear(mlp.down_proj),
    )


class Decoder:
    """The prefill/decode forward of one HF model (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        base = model.model
        self.embed = base.embed_tokens.weight
        self.rope = _Rope(base.rotary_emb, self.embed.dtype, self.embed.device)
        self.layers = [_layer(block) for block in base.layers[: cfg.num_hidden_layers]]
        self.norm = _norm(base.norm)
        self.lm_head = model.lm_head.weight
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.scale = self.head_dim**-0.5
        self.zero = self.embed.new_zeros(())
        self.minus_inf = self.embed.new_full((), float("-inf"))

    def empty_cache(self, rows: int, cap: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Unset keys and values, per layer (rows, H_kv, cap, D), in the model's dtype (a
        prefill writes every column it reads)."""
        shape = (rows, self.kv_heads, cap, self.head_dim)
        keys = [self.embed.new_empty(shape) for _ in self.layers]
        return keys, [self.embed.new_empty(shape) for _ in self.layers]

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        column: int,
        mask: torch.Tensor,
        keep: int = 1,
        start: int = 0,
    ) -> torch.Tensor:
        """tokens, pos: (B, T) int64, written to cache columns [column, column + T);
        keys/values: per layer (B, H_kv, cap, D), attended from column `start` on (the
        columns before are padding in every row); mask: (B, 1, T, column + T - start)
        bool, True where a query may attend. Returns the logits of the last `keep`
        positions (B, keep, V)."""
        x = F.embedding(tokens, self.embed)  # (B, T, hidden)
        # SDPA turns a bool mask into this additive one in every layer; once is enough
        mask = torch.where(mask, self.zero, self.minus_inf)
        end = column + tokens.shape[1]
        # a position never exceeds the row's column count, so `end` bounds them all
        cos, sin = self.rope(pos, end)  # (B, T, 1, D)
        for layer, k_cache, v_cache in zip(self.layers, keys, values, strict=True):
            h = layer.norm_in(x)
            span = (column, end, start)
            x += self._attend(layer, h, cos, sin, k_cache, v_cache, span, mask)
            h = layer.norm_post(x)
            x += layer.down(F.silu(layer.gate(h), inplace=True).mul_(layer.up(h)))
        if keep < x.shape[1]:
            x = x[:, -keep:]
        return F.linear(self.norm(x), self.lm_head)

    def _attend(
        self,
        layer: _Layer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: tuple[int, int, int],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        column, end, start = span  # write [column, end), attend to [start, end)
        b, t, d = h.shape[0], h.shape[1], self.head_dim
        # (B, T, heads, D) throughout: for one query that is already SDPA's packed layout
        q = layer.q(h).view(b, t, self.heads, d)
        k = layer.k(h).view(b, t, self.kv_heads, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        v = layer.v(h).view(b, t, self.kv_heads, d)
        q = q * cos + _swap_halves(q) * sin
        k = k * cos + _swap_halves(k) * sin
        k_cache[:, :, column:end] = k.transpose(1, 2)
        v_cache[:, :, column:end] = v.transpose(1, 2)
        keys, values = k_cache[:, :, start:end], v_cache[:, :, start:end]
        rep = self.heads // self.kv_heads
        if t == 1:  # the query heads of a KV head become its rows (HF's pack_gqa)
            q = q.view(b, self.kv_heads, rep, d)
            if q.dtype == torch.float32:
                out = _one_query(q, keys, values, mask, self.scale)
                return layer.o(out.reshape(b, t, self.heads * d))
        else:
            q = q.transpose(1, 2)  # (B, H, T, D)
            if rep > 1:  # HF's repeat_kv
                keys, values = _repeat_kv(keys, rep), _repeat_kv(values, rep)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        if t > 1:
            out = out.transpose(1, 2)  # (B, T, H, D); for one query (B, H_kv, rep, D) is that
        return layer.o(out.reshape(b, t, self.heads * d))


def _one_query(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA's function for a decode step in float32: q (B, H_kv, rep, D) against
    keys/values (B, H_kv, L, D), additive mask (B, 1, 1, L). Two batched matmuls and a
    softmax cost less than SDPA's CPU kernel for a few dozen keys; the sums run in
    another order, so the logits move by float32 rounding only (about 1e-6, far below
    what could change a sampled token's probability by 1e-6; tests/unit/test_decoder.py)."""
    scores = torch.matmul(q * scale, keys.transpose(-1, -2)).add_(mask)  # (B, H_kv, rep, L)
    return torch.matmul(torch.softmax(scores, dim=-1), values)  # (B, H_kv, rep, D)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """(x2, x1) for x = (x1, x2) on the last dim; times the signed sin it is
    HF's rotate_half(x) * sin, bit for bit (a negation is exact)."""
    return torch.roll(x, x.shape[-1] // 2, dims=-1)


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)


def for_model(model: Any) -> Decoder | None:
    """The lean decoder of `model`, or None where HF's forward must run."""
    if type(model).__name__ not in SUPPORTED or not type(model).__module__.startswith(
        "transformers."
    ):
        return None
    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    # dynamic / longrope scaling change the frequencies with the sequence length: no table
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if (
        rope_type in ("dynamic", "longrope")
        or getattr(cfg, "_attn_implementation", None) != "sdpa"
        or set(layer_types) != {"full_attention"}
        or getattr(cfg, "hidden_act", None) != "silu"
        # F.linear on the weights is right for plain Linear layers only (not quantized ones)
        or any(
            isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear
            for m in model.modules()
        )
    ):
        return None
    return Decoder(model)
