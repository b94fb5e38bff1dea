"""`load_model`'s direct path (`load_direct`) gives what `from_pretrained` gives: the same
tensors, buffers, config, generation config and tied weights; a directory it does not
apply to goes through `from_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_hex.config import TinyModelConfig
from areal_hex.models import build_tiny_model, build_tokenizer, load_direct, load_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = build_tokenizer()
    cfg = TinyModelConfig(num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4,
                          num_kv_heads=2, max_position_embeddings=64)  # fmt: skip
    out = tmp_path_factory.mktemp("tiny")
    build_tiny_model(cfg, tok, seed=3).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def test_direct_load_equals_from_pretrained(saved: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    before = torch.random.get_rng_state()
    direct = load_direct(saved)
    assert direct is not None
    assert torch.equal(torch.random.get_rng_state(), before)  # draws nothing
    ref = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    got = load_model(saved)
    assert not got.training
    for model in (direct, got):
        mine, theirs = dict(model.state_dict()), dict(ref.state_dict())
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
        buffers, ref_buffers = dict(model.named_buffers()), dict(ref.named_buffers())
        assert buffers.keys() == ref_buffers.keys()
        assert all(torch.equal(buffers[k], ref_buffers[k]) for k in buffers)
        assert model.config.to_dict() == ref.config.to_dict()
        assert model.generation_config.to_dict() == ref.generation_config.to_dict()
        assert model.config._attn_implementation == ref.config._attn_implementation
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 9, 12, 40]])
    assert torch.equal(got(ids).logits, ref(ids).logits)


def test_what_the_direct_path_leaves_to_from_pretrained(saved: Path, tmp_path: Path) -> None:
    import shutil

    import torch

    assert load_direct(saved, "bfloat16") is None  # stored as float32: from_pretrained casts
    assert load_model(saved, dtype="bfloat16").dtype == torch.bfloat16
    for change in ({"quantization_config": {"quant_method": "x"}}, {"auto_map": {}}):
        other = tmp_path / next(iter(change))
        shutil.copytree(saved, other)
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, **change}))
        assert load_direct(other) is None
    assert load_direct(tmp_path / "absent") is None
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    assert load_direct(broken) is None
