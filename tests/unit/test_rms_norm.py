"""The trainer's RMSNorm (trainer_service/rms_norm.py) gives transformers' RMSNorm
outputs and gradients (to 1e-6), and is switched in only where the formula is the same."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from trainer_service import rms_norm


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 5, 4, 16)], ids=["hidden", "per-head"])
def test_same_values_and_gradients_as_transformers(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    ref = Qwen3RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(shape[-1], generator=gen) + 0.5)
    norm = copy.deepcopy(ref)
    assert rms_norm.fuse(norm) == 1
    x = (3 * torch.randn(*shape, generator=gen)).requires_grad_()
    g = torch.randn(*shape, generator=gen)
    got = []
    for m in (ref, norm):
        x.grad = None
        y = m(x)
        y.backward(g)
        got.append((y.detach(), x.grad.clone(), m.weight.grad.clone()))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    assert got[0][1].abs().sum() > 0


def test_other_dtypes_and_formulas_keep_their_own() -> None:
    norm = Qwen3RMSNorm(8)
    assert rms_norm.fuse(norm) == 1
    x = torch.randn(2, 8).to(torch.bfloat16)
    assert torch.equal(norm(x), Qwen3RMSNorm.forward(norm, x))  # the class's own maths
    gemma = GemmaRMSNorm(8)  # scales by 1 + weight
    assert rms_norm.fuse(gemma) == 0 and "forward" not in vars(gemma)
    assert rms_norm.fuse(Qwen3RMSNorm(8).to(torch.bfloat16)) == 0


def test_every_norm_of_the_model(tmp_path: object) -> None:
    from areal_hex.config import ModelConfig, TinyModelConfig
    from areal_hex.models import load_model, materialize

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=2)), tmp_path)
    model = load_model(d)
    # per layer: input, post-attention, query and key norms; then the final norm
    assert rms_norm.fuse(model) == 2 * 4 + 1
