"""RMSNorm with its backward written out, for the trainer's fp32 model.

y = w * x / rms(x), rms(x) = sqrt(mean(x^2) + eps) over the last dimension. Autograd
through transformers' RMSNorm records seven ops (square, mean, add, rsqrt, two products,
a cast) and runs the backward of each, the mean's as a division of an expanded tensor;
here the forward makes the same ops (so the same values) and the backward is

    x_hat = x / rms(x),   g_hat = g * w
    dx = (g_hat - x_hat * mean(g_hat * x_hat)) / rms(x),   dw = sum of g * x_hat

in six passes over contiguous tensors (for dx a product, a fused product-sum, a fused
multiply-add and a scaling; for dw a product and a sum). Only the norm classes known to
compute exactly `weight * x / rms(x)` in fp32 are switched (a Gemma norm scales by
1 + weight, and is left alone).
"""

from __future__ import annotations

import types
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# transformers' norms that compute weight * (x * rsqrt(mean(x^2) + eps))
_SAME_FORMULA = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def fuse(model: Any) -> int:
    """Switch the RMSNorms of `model` (an HF model, or a DeepSpeed engine over one) whose
    weights are fp32 to `rms_norm` (an input of another dtype still takes the class's
    own forward); returns how many were switched."""
    import torch

    module = getattr(model, "module", model)
    switched = 0
    for m in module.modules():
        if type(m).__name__ not in _SAME_FORMULA or m.weight.dtype != torch.float32:
            continue
        m.forward = types.MethodType(_forward, m)
        switched += 1
    return switched


def _forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    import torch

    if hidden_states.dtype != torch.float32 or self.weight.dtype != torch.float32:
        return type(self).forward(self, hidden_states)  # its own mixed-precision maths
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, -1) + eps), for fp32 `x` and `weight`."""
    return _function().apply(x, weight, eps)


@cache
def _function() -> Any:
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
            inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            x_hat = x * inv
            ctx.save_for_backward(x_hat, inv, w)
            return w * x_hat

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, Any, None]:
            x_hat, inv, w = ctx.saved_tensors
            dx = dw = None
            if ctx.needs_input_grad[0]:
                g_hat = g * w
                # -mean(g_hat * x_hat), one fused product-sum
                dot = torch.linalg.vecdot(g_hat, x_hat).unsqueeze(-1).div_(-x_hat.shape[-1])
                dx = torch.addcmul(g_hat, x_hat, dot).mul_(inv)
            if ctx.needs_input_grad[1]:
                dw = (g * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)
            return dx, dw, None

    return RMSNorm
